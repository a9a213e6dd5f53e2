"""Operator tools: diagnose, mats, doctor, bench."""
