"""Routing: which replica serves a request (request router, placement, assignments), and the client that sends
it there and reads its reply stream."""
