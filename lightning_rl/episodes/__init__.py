"""Multi-turn episodes: environments, tools as plain callables, their schemas, and the calculator tool."""
