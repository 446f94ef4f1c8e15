"""The online RL step's stages: rollout engines, the rollout record, the rewards pipeline, filters, log-prob
passes, off-policy correction, advantage estimators, the updater, metrics and collectives."""
