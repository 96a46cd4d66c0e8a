"""Configuration, one place: environment settings (settings), the Serve app (app_config), the base model (model_config)."""
