"""The HTTP edge: the FastAPI app and its routes, the OpenAI schema, errors to HTTP status, auth, quotas, the
status page and the middleware that runs in Serve's HTTP proxy."""
