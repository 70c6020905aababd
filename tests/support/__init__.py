"""Helpers of the tests: real services, a real `kvgraft serve`, tiny models, synthetic and
hostile KV files, the vLLM cluster, certificates, catalog tampering, and what the fixtures of
conftest.py share with the tests (harness). Named so that none shadows a library module;
test modules import from here, never from each other or from conftest.py."""
