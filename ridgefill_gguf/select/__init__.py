"""Exact-row selection: the rule-based selectors (rules.py, the engine's twin) and the maps' token frequency table."""
