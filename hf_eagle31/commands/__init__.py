"""The `hf-eagle31` subcommands, one module each: its options (`configure_parser`) and `run(args)`, thin over the
library (training/, bench/, planner, checkpoints, model_cards/). The top-level `hf_eagle31_cli` imports only the
chosen one, so `hf-eagle31 --help` imports no torch."""
