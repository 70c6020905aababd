"""Moving grafts between a KV file, the store and the machine cache: push, pull, copy,
verify, repair and garbage collection. Each re-checks every byte it reads."""
