"""Test and benchmark harness (never shipped): swarms of real processes, hostile peers."""
