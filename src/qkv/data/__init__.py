"""Datasets: the English->French translation pipeline and the synthetic dates corpus."""
