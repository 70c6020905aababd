"""Helpers of the tests: real services, a real `kvgraft serve`, tiny models, synthetic and
hostile KV files. Named so that none shadows a library module."""
