# Generated package: see scripts/protogen-python.sh.
