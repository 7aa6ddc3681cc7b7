"""datatrove components of the data steps: readers, filters, writers, held-out decontamination."""
