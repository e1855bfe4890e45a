"""Scaling-law sweeps: fitting L(N, D) per architecture, compute frontiers, plots and reports
(issue 14). The planner and launcher live in tools/sweep.py; the statistics live here so they can
be tested without running a single training step."""
