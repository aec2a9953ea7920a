"""The selector service."""
