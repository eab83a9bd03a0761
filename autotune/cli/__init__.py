"""The command line: parse, check, call. Nothing here is imported by the rest."""
