"""Differential conformance: one set of behaviour checks run against pdsim and real SGLang."""
