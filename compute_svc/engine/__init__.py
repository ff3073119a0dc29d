"""Generation: requests, continuous batching, the forward and its decode steps, sampling."""
