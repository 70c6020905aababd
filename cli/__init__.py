"""The kvgraft command line: thin over the registry library."""
