"""The link to the co-located cache daemon: Attach, the Demand stream, one-way signals."""
