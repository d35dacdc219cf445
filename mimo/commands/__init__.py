"""The command line and what each command runs: train, demo, eval, the verify commands, Hugging Face LLaVA import."""
