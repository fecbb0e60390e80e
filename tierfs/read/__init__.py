"""Read path (DESIGN §3): streams and windows, single-flight fetches, landed parts."""
