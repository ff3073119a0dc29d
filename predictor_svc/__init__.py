"""The predictor: traces each request's Expert Activation Matrix (EAM), keeps finished ones in the
EAM collection (EAMC, Redis or embedded), matches live requests against it and publishes
prefetch hints to the cache daemons serving them (the EAMC of MoE-Infinity, arXiv 2401.14361)."""
