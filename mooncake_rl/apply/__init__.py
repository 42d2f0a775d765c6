"""The data plane: execute one worker's routing slice with Store reads and TE writes."""
