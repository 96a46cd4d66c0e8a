"""The demo's assets: a tiny character-level Llama and task adapters anyone can check (assets.py: layout and
reuse; train.py: seeded CPU training; build.py: the training child process). The commands that build and serve
them, `loraland demo-assets` and `loraland demo`, live in app/cli/demo.py."""
