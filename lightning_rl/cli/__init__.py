"""The command line: ``lightning-rl`` (LightningCLI), one-line config errors, key lookups, input checks,
resume and failures of one rank."""
