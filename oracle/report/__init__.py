"""Showing a score: text rendering, and the PNG/CSV/JSON/HTML report. Imports bundle and the root."""
