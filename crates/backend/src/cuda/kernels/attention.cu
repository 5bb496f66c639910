// attention.cu — being written.
