module github.com/pd-controller/pd-controller/adopters/go

go 1.19
