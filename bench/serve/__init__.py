"""`specgate bench serve`: replay workloads through a live gateway and report as vLLM does."""
