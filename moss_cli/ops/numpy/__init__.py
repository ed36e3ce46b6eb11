"""The numpy op table's families (core, gdn, conv, dit), composed into NumpyOps in table.py."""
