"""`dflow-trt bench <what>`: one module per benchmark over the shared timing and reporting in `report`.

Each module's `run(...)` takes checked values (the CLI's parser checks flags) and returns the exit
code; it prints a table and writes a JSON report with the machine it ran on."""
