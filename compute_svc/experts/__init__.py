"""A MoE layer's experts over the daemon's arena: route, acquire, compute, combine."""
