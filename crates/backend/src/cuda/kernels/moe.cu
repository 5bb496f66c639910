// moe.cu — being written.
