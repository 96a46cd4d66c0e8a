"""The demo: a tiny character-level model and task adapters anyone can check (assets, train, build), served on the
local stack with live results (run_demo). Its CLI commands live in app/cli/demo.py."""
