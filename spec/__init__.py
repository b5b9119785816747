"""The packaged specification files (this folder is `spec/` in the source tree)."""
