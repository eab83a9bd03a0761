"""The study: the one history (SQLite), its results, and the files written from them."""
