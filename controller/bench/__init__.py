"""Evaluation: replay scenarios under policies and summarise them (DESIGN §9)."""
