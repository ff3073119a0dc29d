"""Tests of the compute service (compute_svc/): engine, scheduler, cache client, HTTP and gRPC edges."""
