"""The cross-framework integration matrix (run_matrix.py)."""
