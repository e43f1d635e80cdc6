"""``qkv bench``: measure every attention path against its peers (see docs/benchmarks.md)."""
