"""A registry reached over HTTP (`kvgraft serve`): the client, its catalog, the JSON wire
form of catalog records both sides share, and presigned redirects to the store."""
