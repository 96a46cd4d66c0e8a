"""Routing: which replica serves a request (request router, placement, assignments), the client that sends it
there and reads its reply stream, and pushing a new adapter version to the replicas that hold the adapter."""
