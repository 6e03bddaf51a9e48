module zerotrain.example/zerotrain

go 1.19
