"""Placement-to-placement transfer plans and their executors."""
