// matmul.cu — being written.
