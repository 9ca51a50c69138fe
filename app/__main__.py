from app.launch import main

main()
