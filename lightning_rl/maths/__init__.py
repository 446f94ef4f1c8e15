"""Pure PyTorch maths of the objective: losses, advantages, aggregation, trust regions, ratio levels,
preference losses and the validated ``Objective``. Imports torch only."""
