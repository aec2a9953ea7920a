"""The `flowmaker` command line."""
