from nanovllm.serve.cli import main

main()
