"""The predictor: traces each request's Expert Activation Matrix (EAM), keeps finished ones in the
EAM collection (EAMC, Redis or embedded), matches live requests against it and publishes
prefetch hints (DESIGN.md §2, §4; MoE-Infinity arXiv 2401.14361)."""
