"""Tests of the predictor service (predictor_svc/): EAM, EAMC, predict, service, config."""
