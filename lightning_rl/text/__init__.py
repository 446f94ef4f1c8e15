"""Prompts and preference pairs as text and tokens, and the batch column names the DataModules write."""
