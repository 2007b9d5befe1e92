"""Untrusted code in a confined child process: the parent's side and the child's."""
