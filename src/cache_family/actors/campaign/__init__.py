"""The campaign room: rows of one prepared input run on several hosts, merged into one."""
